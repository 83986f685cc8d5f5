"""Attack A (Accelerate): save_state at one opt level, load_state at another."""
import os, tempfile
import torch, torch.nn.functional as F
from torch import nn
from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
import accelerate

def make(level, seed=0):
    accelerate.state.AcceleratorState._reset_state(True)
    torch.manual_seed(seed)
    if level == "32":
        acc = accelerate.Accelerator(cpu=True)
    else:
        acc = Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]) 
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt

def train(acc, model, opt, n=3):
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        acc.backward(F.cross_entropy(model(x), y)); opt.step(); opt.zero_grad()

def run(src, dst, d):
    path = os.path.join(d, f"{src}-{dst}")
    acc, model, opt = make(src)
    train(acc, model, opt)
    acc.save_state(path)
    if src == "O2":
        ref = [m.detach().clone() for m in acc.amp.master_params(opt.optimizer)]
    else:
        ref = [p.detach().clone() for p in model.parameters()]
    acc2, model2, opt2 = make(dst, seed=1)
    try:
        acc2.load_state(path)
    except Exception as e:
        print(f"{src}->{dst}: LOAD RAISED {type(e).__name__}: {str(e)[:300]}")
        return
    got = list(acc2.amp.master_params(opt2.optimizer)) if dst == "O2" else list(model2.parameters())
    exact = sum(bool(torch.equal(a, b)) for a, b in zip(got, ref))
    rounded = sum(bool(torch.equal(a, b.bfloat16().float())) for a, b in zip(got, ref))
    print(f"{src}->{dst}: {exact}/{len(ref)} exact, {rounded} equal the bf16 rounding; {got[0].dtype}")
    try:
        train(acc2, model2, opt2, 2); print("   continued ok")
    except Exception as e:
        print(f"   TRAIN AFTER LOAD RAISED {type(e).__name__}: {e}")

os.environ["ACCELERATE_MIXED_PRECISION"] = ""
with tempfile.TemporaryDirectory() as d:
    run("O1", "O2", d)
    run("O2", "O1", d)
    run("O2", "O2", d)
    run("32", "O2", d)
    run("O0", "O2", d)
