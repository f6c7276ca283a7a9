"""A graph convolutional network in torch_geometric, as its introduction writes it: a Data object,
GCNConv layers, a masked loss."""
# --- setup
import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv

torch.manual_seed(0)


class GCN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(64, 256)
        self.conv2 = GCNConv(256, 7)

    def forward(self, data):
        x, edge_index = data.x, data.edge_index
        x = self.conv1(x, edge_index)
        x = F.relu(x)
        x = F.dropout(x, training=self.training)
        x = self.conv2(x, edge_index)
        return F.log_softmax(x, dim=1)


edge_index = torch.randint(0, 512, (2, 4096))
data = Data(x=torch.randn(512, 64), edge_index=edge_index, y=torch.randint(0, 7, (512,)),
            train_mask=torch.rand(512) < 0.5)
model = GCN()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
# --- step
optimizer.zero_grad()
out = model(data)
loss = F.nll_loss(out[data.train_mask], data.y[data.train_mask])
loss.backward()
optimizer.step()
