"""Attack E: tied GPT-2 (wte/lm_head), fp32_modules=["lm_head"], Accelerate O2 bf16, on_floor="promote", an overflow
injected twice (at the floor: static bf16 scale) into INJECT's gradient; save_state at step K, load into a fresh
run, continue; compare with the uninterrupted run bit for bit."""
import os, sys, tempfile, warnings
import torch
from torch import nn
import transformers
from accelerate.state import AcceleratorState, GradientState
from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
warnings.filterwarnings("ignore")

INJECT = os.environ.get("INJECT", "transformer.h.0.mlp.c_fc.weight")
STEPS, K = 7, 4
OVER = (1, 2)

def gpt2():
    torch.manual_seed(0)
    c = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_inner=64, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2LMHeadModel(c)

def setup():
    AcceleratorState._reset_state(True); GradientState._reset_state()
    acc = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(
        half_dtype="bfloat16", fp32_modules=["lm_head"], on_floor="promote")])
    m = gpt2()
    m, o = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=3e-3))
    return acc, m, o

def ids(step):
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(step))

def steps(acc, m, o, start, stop):
    inner = acc.unwrap_model(m)
    params = dict(inner.named_parameters())
    for s in range(start, stop):
        x = ids(s)
        acc.backward(m(input_ids=x, labels=x).loss)
        if s in OVER:
            params[INJECT].grad.view(-1)[0] = float("inf")
        o.step(); o.zero_grad()

def snapshot(acc, m, o):
    inner = acc.unwrap_model(m)
    return {"params": {k: v.detach().clone() for k, v in inner.named_parameters()},
            "dtypes": {k: v.dtype for k, v in inner.named_parameters()},
            "fp32": {k: v.clone() for k, v in acc.amp.fp32_state_dict(inner).items()},
            "promoted": list(acc.amp.promoted_modules), "fp32_modules": list(acc.amp.fp32_modules),
            "tied": inner.lm_head.weight is inner.transformer.wte.weight}

try:
    acc, m, o = setup(); steps(acc, m, o, 0, STEPS); ref = snapshot(acc, m, o)
except Exception as e:
    print("UNINTERRUPTED RAISED", type(e).__name__, str(e)[:400]); sys.exit(1)
print("uninterrupted: promoted", ref["promoted"], "fp32_modules", ref["fp32_modules"], "tied", ref["tied"])
with tempfile.TemporaryDirectory() as d:
    acc, m, o = setup(); steps(acc, m, o, 0, K); acc.save_state(d)
    acc, m, o = setup()
    try:
        acc.load_state(d)
        steps(acc, m, o, K, STEPS)
    except Exception as e:
        print("RESUMED RAISED", type(e).__name__, str(e)[:600]); sys.exit(1)
    got = snapshot(acc, m, o)
print("resumed: promoted", got["promoted"], "tied", got["tied"])
bad = [k for k in ref["params"] if not torch.equal(ref["params"][k], got["params"][k]) or ref["dtypes"][k] != got["dtypes"][k]]
badfp = [k for k in ref["fp32"] if not torch.equal(ref["fp32"][k], got["fp32"][k])]
print("param mismatches:", bad[:6], len(bad), "fp32 export mismatches:", badfp[:6], len(badfp))
