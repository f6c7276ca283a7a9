"""A LightningModule trained by Trainer.fit, as Lightning's docs write it: the step's forward and
backward run inside the framework's loop."""
# --- setup
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                       torch.nn.ReLU(), torch.nn.Linear(512, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


model = LitModel()
loader = DataLoader(TensorDataset(torch.randn(256, 64), torch.randn(256, 1)), batch_size=256)
trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
# --- step
trainer.fit(model, loader)
