"""GPU memory of one step per schedule, as tests/test_cuda.py's memory test measures it."""
import torch
from torch import nn
from torchpipe import Pipe

print("torchpipe from", __import__("torchpipe").__file__)
torch.backends.cuda.matmul.allow_tf32 = False
CUDA = torch.device("cuda", 0)
torch.manual_seed(0)
width = 1024
layers = [nn.Linear(width, width) if i % 2 == 0 else nn.Tanh() for i in range(8)]
model = nn.Sequential(*layers)
x, y = torch.randn(16384, 1024, device=CUDA), torch.randn(16384, 1024, device=CUDA)
MiB = 2 ** 20
with Pipe(model, [2, 2, 2, 2], devices=["cuda:0"] * 4, chunks=16, checkpoint="never") as pipe:
    pipe.step(x, y, nn.MSELoss(), schedule="gpipe")
    for schedule in ("gpipe", "1f1b", "gpipe", "1f1b", "zb-h1"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        after = torch.cuda.memory_allocated() - base
        mem = pipe.last_memory
        print(f"{schedule:6s} peak {peak / MiB:7.1f} MiB  after {after / MiB:6.1f} MiB  {getattr(mem, '__dict__', mem)}")
    # the same on a plain model, for scale
    ref = nn.Sequential(*[nn.Linear(width, width) if i % 2 == 0 else nn.Tanh() for i in range(8)]).to(CUDA)
    ref(x[:1024]).sum().backward()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    nn.MSELoss()(ref(x[:1024]), y[:1024]).backward(); torch.cuda.synchronize()
    print(f"plain one micro-batch: peak {(torch.cuda.max_memory_allocated() - base) / MiB:.1f} MiB")
