"""At O3, loss functions on arguments of two floating dtypes run in the widest of them.

Apex's O3 is pure half: the model is cast, nothing is patched (``patch_torch_functions=False``), and its outputs are
cast to FP32 (``cast_model_outputs``'s default). A target made in the model's dtype (``y.to(self.dtype)``, half since
the plugins report the weights' dtype) then meets an FP32 output: ``mse_loss`` or ``kl_div`` promote the pair
themselves, but ``huber_loss``, ``binary_cross_entropy`` and a few others refuse it ("Found dtype BFloat16 but
expected Float"), where Lightning's ``"bf16-true"`` (half outputs) trains. The O3 policy promotes only such a mixed
call, to the dtype torch's own promotion gives (a half value is exact in FP32, so the narrower argument loses
nothing); a call whose floating arguments share one dtype runs as given, so a loss that a model computes on its half
logits stays half, as at Apex's O3. Other strict-dtype ops (``torch.lerp``) are not losses and are left alone, as
at O2.

The policy is O2's mechanism with :meth:`~lightning_mpx.casting.table.CastTable.default_o3`: a torch-function mode
in the forward scope, taken off inside the submodules whose code computes no loss
(:mod:`~lightning_mpx.casting.loss_regions`), so the half blocks pay no Python per op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_mpx.casting.policy import CastPolicy
from lightning_mpx.casting.table import CastTable

if TYPE_CHECKING:
    from lightning_mpx.opt_levels import Properties


def o3_policy(props: Properties) -> CastPolicy | None:
    """The cast policy of a half model without FP32 masters (O3), or ``None`` for a model that is not cast (O0).

    Its table is :meth:`CastTable.default_o3`, run by the Python mode (``engine="mode"``): ``torch.autocast`` would
    cast far more than the loss functions.
    """
    if not props.casts_model or props.patch_torch_functions:
        return None
    return CastPolicy(CastTable.default_o3(), props.half_dtype, engine="mode")
