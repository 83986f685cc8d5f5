"""Attack B: Accelerate DDP (2 gloo procs via accelerate launch), skip_on_device on/off, fused AdamW, dynamic scale,
overflow on one rank only, rank-0-only reads. Run: python attacks2/b_accelerate_ddp_skip.py (it launches itself)."""
import json, os, subprocess, sys, socket
from pathlib import Path
import torch, torch.nn.functional as F
from torch import nn

OVER = {1: (0,), 3: (1,), 5: (0,)}  # last step included

def worker(out: Path, skip: bool, half: str):
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    acc = Accelerator(mixed_precision="O1", cpu=True,
                      kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, loss_scale="dynamic", skip_on_device=skip)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    inner = acc.unwrap_model(model)
    rank = acc.process_index
    seen, outs = [], []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        acc.backward(F.cross_entropy(model(x), y))
        if rank in OVER.get(step, ()):
            inner[0].weight.grad[0, 0] = float("inf")
        opt.step()
        outcome = opt._stepped
        opt.zero_grad()
        outs.append(outcome)
        if acc.is_main_process:
            seen.append({"skipped": bool(acc.optimizer_step_was_skipped), "bool": bool(outcome),
                         "metrics": acc.mpx_metrics()})
            acc.log({"x": 1.0}, step=step)
    if acc.is_main_process:
        seen.append({"final_int": int(outcome)})
    acc.wait_for_everyone()
    params = {k: v.detach().tolist() for k, v in inner.named_parameters()}
    (out / f"b_{skip}_{half}_rank{rank}.json").write_text(json.dumps({"seen": seen, "params": params,
        "scale": acc.amp.scalers[0].get_scale(), "skipped_steps": list(acc.amp.skipped_steps)}, default=str))
    acc.end_training()

if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]); sys.exit(0)
    out = Path("/tmp/attack2_b"); out.mkdir(exist_ok=True)
    for half in ("bfloat16", "float16"):
        for skip in ("0", "1"):
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(port), __file__, str(out), skip, half]
            try:
                r = subprocess.run(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=140)
                print(half, "skip", skip, "rc", r.returncode, r.stderr[-1500:] if r.returncode else "")
            except subprocess.TimeoutExpired:
                print(half, "skip", skip, "TIMEOUT (hang)")
                continue
        res = {}
        for skip in ("0", "1"):
            try:
                res[skip] = [json.loads((out / f"b_{skip == '1'}_{half}_rank{r}.json").read_text()) for r in range(2)]
            except FileNotFoundError:
                pass
        for skip, rr in res.items():
            print(half, skip, "skipped_steps", [x["skipped_steps"] for x in rr], "scale", [x["scale"] for x in rr])
            print("   rank0 reads", [(d.get("skipped"), d.get("bool")) for d in rr[0]["seen"][:-1]], rr[0]["seen"][-1])
        if len(res) == 2:
            print(half, "params equal across skip modes:", res["0"][0]["params"] == res["1"][0]["params"],
                  "ranks equal:", res["1"][0]["params"] == res["1"][1]["params"])
