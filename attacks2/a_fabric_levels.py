"""Attack A (Fabric): resume across opt levels with fabric.save/fabric.load, in both key orders of the state."""
import sys, tempfile, os
import torch, torch.nn.functional as F
from torch import nn
from lightning.fabric import Fabric
from lightning_mpx import FabricMixedPrecisionPlugin

def make(level, seed=0):
    torch.manual_seed(seed)
    mpx = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16") if level != "32" else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx] if mpx else None)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    if mpx is not None:
        mpx.setup_optimizers(opt)
    return fabric, mpx, model, opt

def train(fabric, model, opt, n=3):
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        fabric.backward(F.cross_entropy(model(x), y)); opt.step(); opt.zero_grad()

def state(model, opt, mpx, mpx_first):
    if mpx is None:
        return {"model": model, "optimizer": opt}
    if mpx_first:
        return {"mpx": mpx, "model": model, "optimizer": opt}
    return {"model": model, "optimizer": opt, "mpx": mpx}

def run(src, dst, mpx_first, d):
    path = os.path.join(d, f"{src}-{dst}-{mpx_first}.ckpt")
    fabric, mpx, model, opt = make(src)
    train(fabric, model, opt)
    fabric.save(path, state(model, opt, mpx, mpx_first))
    if src == "O2":
        ref = [m.detach().clone() for m in mpx.amp.master_params(opt.optimizer)]
    else:
        ref = [p.detach().clone() for p in model.parameters()]
    assert all(r.dtype == torch.float32 for r in ref)
    fabric2, mpx2, model2, opt2 = make(dst, seed=1)
    st = state(model2, opt2, mpx2, mpx_first)
    if src == "32":
        st = {"model": model2, "optimizer": opt2, **({"mpx": mpx2} if mpx_first is None else {})}
    try:
        rest = fabric2.load(path, st, strict=False)
    except Exception as e:
        print(f"{src}->{dst} mpx_first={mpx_first}: LOAD RAISED {type(e).__name__}: {e}")
        return
    if dst == "O2":
        got = list(mpx2.amp.master_params(opt2.optimizer))
    else:
        got = list(model2.parameters())
    exact = sum(bool(torch.equal(a.float(), b)) for a, b in zip(got, ref))
    print(f"{src}->{dst} mpx_first={mpx_first}: {exact}/{len(ref)} exact; dtypes {[g.dtype for g in got][:1]}")
    try:
        train(fabric2, model2, opt2, 2)
        print("   continued training ok")
    except Exception as e:
        print(f"   TRAINING AFTER LOAD RAISED {type(e).__name__}: {e}")

with tempfile.TemporaryDirectory() as d:
    for mf in (False, True):
        run("O1", "O2", mf, d)
        run("O2", "O1", mf, d)
        run("O2", "O2", mf, d)
        run("O2", "O3", mf, d)
    run("32", "O2", False, d)
