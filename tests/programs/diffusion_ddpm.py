"""A diffusers DDPM training step as its training tutorial writes it: noise and timesteps drawn from
the batch, the noisy images through a UNet2DModel, MSE on the noise."""
# --- setup
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel

torch.manual_seed(0)
model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                    block_out_channels=(16, 32), down_block_types=("DownBlock2D", "DownBlock2D"),
                    up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
clean_images = torch.randn(8, 3, 16, 16)
# --- step
noise = torch.randn(clean_images.shape)
bs = clean_images.shape[0]
timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bs,), dtype=torch.int64)
noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)
noise_pred = model(noisy_images, timesteps, return_dict=False)[0]
loss = F.mse_loss(noise_pred, noise)
loss.backward()
optimizer.step()
optimizer.zero_grad()
