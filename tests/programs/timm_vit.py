"""A timm model trained as timm's docs write a training step: create_model, a loss, AdamW."""
# --- setup
import timm
import torch

torch.manual_seed(0)
model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8,
                          depth=2, drop_rate=0.1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
images, targets = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
# --- step
output = model(images)
loss = loss_fn(output, targets)
optimizer.zero_grad()
loss.backward()
optimizer.step()
