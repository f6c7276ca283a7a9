"""LoRA on a transformers model with peft, as peft's quicktour writes it: get_peft_model, then a
training step on the wrapped model (only the adapters train)."""
# --- setup
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64))
config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True)
model = get_peft_model(base, config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = {"input_ids": torch.randint(0, 256, (8, 48))}
batch["labels"] = batch["input_ids"]
# --- step
outputs = model(**batch)
loss = outputs.loss
loss.backward()
optimizer.step()
optimizer.zero_grad()
