import sys, json, torch
sys.path.insert(0, "scripts/reference")
from torch_chat_sft import padded_batch, packed_batch, read_steps
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained("data/smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32).eval()
s = read_steps("/tmp/xcheck/steps.jsonl", 1)[0]
dev = torch.device("cpu")
with torch.no_grad():
    print("padded", m(**padded_batch(*s, dev)).loss.item())
    print("packed", m(**packed_batch(*s, dev)).loss.item())
