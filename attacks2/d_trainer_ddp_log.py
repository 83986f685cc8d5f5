"""Attack D: Trainer DDP (2 gloo procs), skip_on_device on/off (SKIP env), overflow on one rank, rank-0-only
self.log of float(outcome) (manual optimization) and of mpx metrics in on_train_batch_end (automatic).
MODE env: manual | auto. ON_FLOOR env: continue | raise (bf16 static -> floor)."""
import os, sys, json
import torch, torch.nn.functional as F
from torch import nn
import lightning as L
from lightning_mpx import MixedPrecisionPlugin

SKIP = os.environ.get("SKIP", "1") == "1"
MODE = os.environ.get("MODE", "manual")
ON_FLOOR = os.environ.get("ON_FLOOR", "continue")
OVER = {1: 0, 3: 1, 5: 0}

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.automatic_optimization = MODE != "manual"
        self.seen = []
    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if OVER.get(i) == self.global_rank:
            self.net[0].weight.grad[0, 0] = float("inf")
        opt.step()  # Lightning returns the closure's result here, not whether it stepped (as its own precisions)
        if self.trainer.is_global_zero:
            outcome = not self.trainer.precision_plugin.step_was_skipped(opt.optimizer)
            self.log("stepped", float(outcome), rank_zero_only=True)
            self.seen.append(float(outcome))
        return loss
    def on_after_backward(self):
        if self.automatic_optimization and OVER.get(self.trainer.fit_loop.batch_idx) == self.global_rank:
            self.net[0].weight.grad[0, 0] = float("inf")
    def on_train_batch_end(self, out, batch, i):
        if self.trainer.is_global_zero and self.automatic_optimization:
            mpx = self.trainer.precision_plugin
            m = mpx.metrics()
            self.log_dict({k: float(v) for k, v in m.items()}, rank_zero_only=True)
            self.seen.append(mpx.step_was_skipped(self.optimizers().optimizer))
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

def data():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)

if __name__ == "__main__":
    mpx = MixedPrecisionPlugin("O1", half_dtype="bfloat16", skip_on_device=SKIP, on_floor=ON_FLOOR)
    t = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx], max_steps=6, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    m = M()
    try:
        t.fit(m, data())
        print(f"[rank {t.global_rank}] done seen={m.seen} skipped={list(mpx.amp.skipped_steps)} "
              f"p0={m.net[0].weight.sum().item():.8f}", file=sys.stderr, flush=True)
    except Exception as e:
        print(f"[rank {t.global_rank}] RAISED {type(e).__name__}: {str(e)[:200]}", file=sys.stderr, flush=True)
        sys.exit(3)
