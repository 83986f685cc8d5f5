"""diffusers' training scripts through the Accelerate adapter: ``examples/text_to_image/train_text_to_image.py``,
``train_text_to_image_lora.py`` and ``examples/unconditional_image_generation/train_unconditional.py``, ported as a
user would (``from lightning_mpx.accelerate import Accelerator``, ``mixed_precision="O1"``/``"O2"``, and the scripts'
``weight_dtype`` read from the opt level's half dtype), each against Accelerate's own ``"bf16"`` and FP32 on the same
code. Tiny models built from configs (a ``UNet2DConditionModel`` with cross-attention, an ``AutoencoderKL`` and a CLIP
text encoder frozen and cast to ``weight_dtype`` by hand; a ``UNet2DModel``), a DDPM noise-prediction loss, and the
scripts' habits: ``set_seed``, ``EMAModel`` stepped after ``sync_gradients`` and swapped in for validation
(``store``/``copy_to``/``restore``) and saved inside that swap, the checkpoint hooks that save the UNet and the EMA
with ``save_pretrained`` (``weights.pop()``) and load them back, ``accumulate``, ``clip_grad_norm_``, an LR
scheduler, ``save_state``/``load_state`` resume, ``unwrap_model(unet).save_pretrained`` then ``from_pretrained``,
LoRA through ``unet.add_adapter`` with ``cast_training_params``, ``enable_gradient_checkpointing()``, and one tiny
float16 case through the loss scale's overflow path. bfloat16 elsewhere, on CPU (diffusers 0.39.0: the newest that
installs beside huggingface_hub 1.3.7)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from accelerate.utils import set_seed  # noqa: E402
from diffusers import AutoencoderKL, DDPMPipeline, DDPMScheduler, UNet2DConditionModel, UNet2DModel  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),
    # diffusers' own notes: AutoencoderKL cast with .to() (the scripts' habit), deprecations of its config keys
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

HALF = torch.bfloat16
LR = 1e-3
LEVELS = ("O1", "O2")
BATCHES = 6  # micro-batches of 2 images; accumulated in pairs: 3 optimizer steps
WEIGHTS = "diffusion_pytorch_model.safetensors"


# -- the models, from configs -------------------------------------------------------------------------------------
def _unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, norm_num_groups=4, attention_head_dim=2,
    )  # fmt: skip


def _vae() -> AutoencoderKL:
    torch.manual_seed(1)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), latent_channels=4, layers_per_block=1,
        norm_num_groups=4, sample_size=16,
    )  # fmt: skip


def _text_encoder() -> CLIPTextModel:
    torch.manual_seed(2)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=8, projection_dim=16,
    ))  # fmt: skip


def _unconditional_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=4,
    )  # fmt: skip


def _images(n: int = BATCHES * 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"pixel_values": torch.randn(3, 16, 16, generator=g), "input_ids": torch.randint(0, 32, (8,), generator=g)}
            for _ in range(n)]  # fmt: skip


# -- the scripts' set-up -------------------------------------------------------------------------------------------
def _accelerator(mode: str, **kwargs: Any) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if mode in ("no", "bf16", "fp16"):
        return NativeAccelerator(mixed_precision=mode, cpu=True, **kwargs)
    half = kwargs.pop("half_dtype", HALF)
    mpx = {name: kwargs.pop(name) for name in ("init_scale",) if name in kwargs}
    return Accelerator(mixed_precision=mode, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, **mpx)], **kwargs)


def _weight_dtype(accelerator: Any) -> torch.dtype:
    """The scripts' ``weight_dtype`` (what the frozen parts are cast to), ported: Accelerate's ``"fp16"``/``"bf16"``
    as the scripts read them; with an opt level, ``accelerator.mixed_precision`` is ``"O1"``/``"O2"``, and the half
    dtype is the engine's."""
    if accelerator.mixed_precision == "fp16":
        return torch.float16
    if accelerator.mixed_precision == "bf16":
        return torch.bfloat16
    if getattr(accelerator, "amp", None) is not None:
        return accelerator.amp.properties.half_dtype
    return torch.float32


@dataclass
class _Run:
    accelerator: Any
    unet: Any
    optimizer: Any
    loader: Any
    lr_scheduler: Any
    ema: EMAModel | None
    vae: Any = None
    text_encoder: Any = None
    noise_scheduler: DDPMScheduler = field(default_factory=lambda: DDPMScheduler(num_train_timesteps=1000))
    weight_dtype: torch.dtype = torch.float32
    losses: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)


def _checkpoint_hooks(accelerator: Any, ema: EMAModel, model_cls: type) -> None:
    """The scripts' ``save_model_hook``/``load_model_hook``: the UNet and its EMA as ``save_pretrained`` folders,
    ``weights.pop()`` so that Accelerate does not write the model again; loaded back with ``from_pretrained``."""

    def save_model_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if accelerator.is_main_process:
            ema.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for model in models:
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()

    def load_model_hook(models: list[Any], input_dir: str) -> None:
        load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), model_cls)
        ema.load_state_dict(load_model.state_dict())
        ema.to(accelerator.device)
        for _ in range(len(models)):
            model = models.pop()
            load_model = model_cls.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**load_model.config)
            model.load_state_dict(load_model.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)


def _text_to_image(mode: str, *, ema: bool = True, hooks: bool = False, checkpointing: bool = False) -> _Run:
    """``train_text_to_image.py``'s set-up, in its order."""
    accelerator = _accelerator(mode, gradient_accumulation_steps=2)
    set_seed(0)
    text_encoder, vae, unet = _text_encoder(), _vae(), _unet()
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()
    ema_unet = EMAModel(_unet().parameters(), model_cls=UNet2DConditionModel, model_config=unet.config) if ema else None
    if hooks:
        assert ema_unet is not None
        _checkpoint_hooks(accelerator, ema_unet, UNet2DConditionModel)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(_images(), batch_size=2)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer, num_warmup_steps=2)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)
    if ema_unet is not None:
        ema_unet.to(accelerator.device)
    weight_dtype = _weight_dtype(accelerator)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    return _Run(accelerator, unet, optimizer, loader, lr_scheduler, ema_unet, vae, text_encoder,
                weight_dtype=weight_dtype)  # fmt: skip


def _text_to_image_loss(run: _Run, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    latents = run.vae.encode(batch["pixel_values"].to(run.weight_dtype)).latent_dist.sample()
    latents = latents * run.vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, run.noise_scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
    noisy_latents = run.noise_scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = run.text_encoder(batch["input_ids"])[0]
    model_pred = run.unet(noisy_latents, timesteps, encoder_hidden_states).sample
    return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")


def _unconditional_loss(run: _Run, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    clean_images = batch["pixel_values"][:, :, :8, :8].to(run.weight_dtype)
    noise = torch.randn(clean_images.shape, dtype=run.weight_dtype)
    timesteps = torch.randint(0, run.noise_scheduler.config.num_train_timesteps, (clean_images.shape[0],)).long()
    noisy_images = run.noise_scheduler.add_noise(clean_images, noise, timesteps)
    model_output = run.unet(noisy_images, timesteps).sample
    return F.mse_loss(model_output.float(), noise.float())


def _train(run: _Run, batches: Any, loss_of: Any = _text_to_image_loss, max_grad_norm: float = 1.0) -> None:
    """The scripts' loop: ``accumulate``, ``backward``, ``clip_grad_norm_`` under ``sync_gradients``, the steps, then
    the EMA after ``sync_gradients``."""
    accelerator, unet = run.accelerator, run.unet
    for batch in batches:
        with accelerator.accumulate(unet):
            loss = loss_of(run, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(unet.parameters(), max_grad_norm)
            run.optimizer.step()
            run.lr_scheduler.step()
            run.optimizer.zero_grad()
        if accelerator.sync_gradients:
            run.skipped.append(bool(getattr(run.optimizer, "step_was_skipped", False)))
            if run.ema is not None:
                run.ema.step(unet.parameters())
        run.losses.append(loss.item())


def _fp32_weights(run: _Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in run.accelerator.get_state_dict(run.unet).items()}


def _relative(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """How far ``got`` moved from ``start`` unlike ``ref`` did, over how far ``ref`` moved (0: the same update)."""
    num = sum(((got[k] - start[k]) - (ref[k] - start[k])).pow(2).sum() for k in ref)
    den = sum((ref[k] - start[k]).pow(2).sum() for k in ref)
    return float((num / den).sqrt())


def _ema_weights(ema: EMAModel, names: list[str]) -> dict[str, torch.Tensor]:
    return {name: shadow.detach().float().clone() for name, shadow in zip(names, ema.shadow_params)}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    """``train_text_to_image.py`` under Accelerate's own ``"no"`` (FP32) and ``"bf16"``: losses, FP32 weights, EMA."""
    from tests.accelerate_helpers import accelerate_state_reset

    out = {}
    with accelerate_state_reset():
        for mode in ("no", "bf16"):
            run = _text_to_image(mode)
            _train(run, run.loader)
            names = [n for n, _ in run.accelerator.unwrap_model(run.unet).named_parameters()]
            out[mode] = {"losses": run.losses, "weights": _fp32_weights(run), "ema": _ema_weights(run.ema, names)}
    return out


# -- train_text_to_image.py ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
def test_text_to_image_trains_as_bf16_and_fp32_and_exports_fp32(
    level: str, references: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The script's loop (frozen VAE and text encoder cast to ``weight_dtype`` by hand, ``accumulate`` over 2,
    ``clip_grad_norm_``, a warm-up schedule, the EMA after ``sync_gradients``) gives the losses, FP32 weights and EMA
    of ``"bf16"`` and FP32 (bfloat16's tolerance), and the final ``unwrap_model(unet).save_pretrained`` writes the
    FP32 weights training produced, which ``from_pretrained`` loads exactly."""
    run = _text_to_image(level)
    unet = run.accelerator.unwrap_model(run.unet)
    assert run.weight_dtype == HALF and run.vae.dtype == HALF and run.text_encoder.dtype == HALF
    assert unet.dtype == (HALF if level == "O2" else torch.float32)  # O2: the UNet is half, its masters FP32
    _train(run, run.loader)
    assert run.skipped == [False] * (BATCHES // 2)  # bfloat16: a static scale of 1, no overflow
    start = {k: v.float() for k, v in _unet().state_dict().items()}
    weights, names = _fp32_weights(run), [n for n, _ in unet.named_parameters()]
    ema = _ema_weights(run.ema, names)
    for mode in ("no", "bf16"):
        ref = references[mode]
        assert run.losses == pytest.approx(ref["losses"], rel=2e-3), mode
        assert _relative(weights, ref["weights"], start) < 0.2, mode  # bf16 vs FP32 itself: 0.044
        if level == "O1":  # O2's EMA averages the half weights: see test_o2_ema_of_the_unet_parameters_*
            assert _relative(ema, ref["ema"], start) < 0.2, mode
    assert {v.dtype for v in weights.values()} == {torch.float32}

    unet.save_pretrained(tmp_path)  # the script's final save (through StableDiffusionPipeline.save_pretrained)
    saved = load_file(tmp_path / WEIGHTS)
    assert saved.keys() == weights.keys()
    assert all(torch.equal(saved[k], weights[k]) for k in weights)  # the FP32 masters, not their rounding
    loaded = UNet2DConditionModel.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())


@pytest.fixture(scope="module")
def o2_emas(references: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``train_text_to_image.py`` at O2 with two EMAs: the script's ``ema_unet.step(unet.parameters())`` (the half
    weights) and one stepped with the FP32 masters (``accelerator.amp.master_of``); each EMA's update away from
    FP32's, relative to its size (:func:`_relative`; ``"bf16"``'s own: 0.046)."""
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        run = _text_to_image("O2")
        unet = run.accelerator.unwrap_model(run.unet)
        of_masters = EMAModel(_unet().parameters(), model_cls=UNet2DConditionModel, model_config=unet.config)
        for batch in run.loader:
            with run.accelerator.accumulate(run.unet):
                run.accelerator.backward(_text_to_image_loss(run, batch))
                if run.accelerator.sync_gradients:
                    run.accelerator.clip_grad_norm_(run.unet.parameters(), 1.0)
                run.optimizer.step()
                run.lr_scheduler.step()
                run.optimizer.zero_grad()
            if run.accelerator.sync_gradients:
                run.ema.step(unet.parameters())
                of_masters.step([run.accelerator.amp.master_of(p) for p in unet.parameters()])
        names = [n for n, _ in unet.named_parameters()]
        start = {k: v.float() for k, v in _unet().state_dict().items()}
        fp32 = references["no"]["ema"]
        return {"half weights": _relative(_ema_weights(run.ema, names), fp32, start),
                "masters": _relative(_ema_weights(of_masters, names), fp32, start)}  # fmt: skip


@pytest.mark.xfail(
    strict=True,
    reason="O2: the UNet's parameters are bfloat16, so EMAModel.step(unet.parameters()) averages their rounding, not "
    "the FP32 weights training produced: 0.18 away from FP32's EMA (relative to its update) where 'bf16' is 0.046; "
    "its first step copies the weights whole, rounding and all. Nothing reaches the EMA's read of a half parameter; "
    "step it with the masters: ema_unet.step([accelerator.amp.master_of(p) for p in unet.parameters()]) (0.047).",
)
def test_o2_ema_of_the_unet_parameters_averages_as_bf16(o2_emas: dict[str, float]) -> None:
    assert o2_emas["half weights"] < 0.1


def test_o2_ema_of_the_masters_averages_as_bf16(o2_emas: dict[str, float]) -> None:
    """The recipe: the EMA stepped with the FP32 masters is as close to FP32's EMA as ``"bf16"``'s (0.046)."""
    assert o2_emas["masters"] < 0.1


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_hooks_resume_as_the_uninterrupted_run(level: str, tmp_path: Path) -> None:
    """The script's hooks (the UNet and its EMA saved with ``save_pretrained``, ``weights.pop()``; loaded with
    ``from_pretrained`` and ``load_state_dict``): 2 optimizer steps, ``save_state``, a fresh Accelerator that
    ``load_state``s and trains 1 more gives the bits of 3 uninterrupted steps (the FP32 weights, the EMA, the
    losses), as under ``"bf16"``."""
    whole = _text_to_image(level, hooks=True)
    batches = list(whole.loader)
    _train(whole, batches[:4])
    whole.accelerator.save_state(str(tmp_path / "checkpoint-2"))
    _train(whole, batches[4:])
    expected, expected_ema = _fp32_weights(whole), [s.clone() for s in whole.ema.shadow_params]

    saved = load_file(tmp_path / "checkpoint-2" / "unet" / WEIGHTS)
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert not (tmp_path / "checkpoint-2" / "model.safetensors").exists()  # weights.pop(): the hook's folder only

    resumed = _text_to_image(level, hooks=True)
    rest = list(resumed.loader)[4:]  # before load_state, which restores the random state save_state saw
    resumed.accelerator.load_state(str(tmp_path / "checkpoint-2"))
    _train(resumed, rest)
    assert resumed.losses == whole.losses[4:]
    got = _fp32_weights(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow_params, expected_ema))
    assert resumed.ema.optimization_step == whole.ema.optimization_step == BATCHES // 2


@pytest.mark.parametrize("level", LEVELS)
def test_gradient_checkpointing_trains_as_without_it(level: str) -> None:
    """``unet.enable_gradient_checkpointing()``: the recomputed forward casts as the first (same bits)."""
    plain = _text_to_image(level, ema=False)
    _train(plain, list(plain.loader)[:4])
    checkpointed = _text_to_image(level, ema=False, checkpointing=True)
    assert checkpointed.accelerator.unwrap_model(checkpointed.unet).is_gradient_checkpointing
    _train(checkpointed, list(checkpointed.loader)[:4])
    assert checkpointed.losses == plain.losses
    expected, got = _fp32_weights(plain), _fp32_weights(checkpointed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# -- train_unconditional.py ----------------------------------------------------------------------------------------
def _unconditional(mode: str, images: int = BATCHES * 2, **kwargs: Any) -> _Run:
    """``train_unconditional.py``'s set-up: the EMA made from the model's own parameters before ``prepare``, with
    its warm-up."""
    accelerator = _accelerator(mode, **kwargs)
    set_seed(0)
    model = _unconditional_unet()
    ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4,
                         model_cls=UNet2DModel, model_config=model.config)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(_images(images), batch_size=2)
    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=images // 2)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    ema_model.to(accelerator.device)
    return _Run(accelerator, model, optimizer, loader, lr_scheduler, ema_model, weight_dtype=torch.float32)


def _ema_swap(run: _Run, out: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The script's epoch end: the EMA weights swapped into the UNet (``store``/``copy_to``), sample images from a
    ``DDPMPipeline`` and the pipeline saved with them, then ``restore``. Returns the images and the saved weights."""
    unet = run.accelerator.unwrap_model(run.unet)
    run.ema.store(unet.parameters())
    run.ema.copy_to(unet.parameters())
    pipeline = DDPMPipeline(unet=unet, scheduler=run.noise_scheduler)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=pipeline.device).manual_seed(0)
    images = pipeline(generator=generator, batch_size=1, num_inference_steps=2, output_type="np").images
    pipeline.save_pretrained(out)
    run.ema.restore(unet.parameters())
    return images, load_file(out / "unet" / WEIGHTS)


@pytest.mark.parametrize("level", LEVELS)
def test_ema_swap_for_samples_and_save_leaves_training_as_without_it(level: str, tmp_path: Path) -> None:
    """The EMA swapped in for the epoch's samples and ``pipeline.save_pretrained``, then ``restore``d: the run goes
    on with the bits of the same run without the swap, as under ``"bf16"`` (``restore`` writes back the exact FP32
    weights). At O2 the save inside the swap used to take the EMA's half rounding into the FP32 masters, and
    ``restore`` then their half rounding: 84% of the masters' elements were left rounded to bfloat16 here (up to
    1.9e-3 off), silently (the save's state dict reads the model's writes without taking them now: the step takes
    them)."""
    plain = _unconditional(level)
    batches = list(plain.loader)
    _train(plain, batches, _unconditional_loss)
    swapped = _unconditional(level)
    batches = list(swapped.loader)
    _train(swapped, batches[:4], _unconditional_loss)
    before = _fp32_weights(swapped)
    images, saved = _ema_swap(swapped, tmp_path)
    assert images.shape == (1, 8, 8, 3) and bool((images >= 0).all() and (images <= 1).all())
    assert {v.dtype for v in saved.values()} == {torch.float32}
    after = _fp32_weights(swapped)
    assert all(torch.equal(after[k], before[k]) for k in before)  # restore: the exact masters
    _train(swapped, batches[4:], _unconditional_loss)
    assert swapped.losses == plain.losses
    expected, got = _fp32_weights(plain), _fp32_weights(swapped)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(torch.equal(a, b) for a, b in zip(swapped.ema.shadow_params, plain.ema.shadow_params))


def _ema_export(level: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    run = _unconditional(level)
    _train(run, list(run.loader)[:4], _unconditional_loss)
    names = [n for n, _ in run.accelerator.unwrap_model(run.unet).named_parameters()]
    return _ema_swap(run, tmp_path)[1], _ema_weights(run.ema, names)


@pytest.mark.parametrize("level", ["bf16", "O1"])
def test_ema_weights_saved_inside_the_swap_are_the_emas(level: str, tmp_path: Path) -> None:
    """The pipeline saved inside the swap holds the EMA's FP32 weights exactly (FP32 parameters take them)."""
    saved, ema = _ema_export(level, tmp_path)
    assert all(torch.equal(saved[k], ema[k]) for k in ema)


@pytest.mark.xfail(
    strict=True,
    reason="O2: the UNet's parameters are bfloat16, so EMAModel.copy_to(unet.parameters()) writes the EMA's bfloat16 "
    "rounding into them, and the pipeline saved inside the swap holds that rounding (every element, up to 2.3e-3 "
    "off here), where 'bf16' saves the FP32 EMA. The FP32 EMA cannot reach a half parameter; save it from the EMA "
    "itself: ema_model.save_pretrained(path), or copy_to an FP32 UNet made from the config (docs/accelerate.md, "
    "'diffusers' training scripts').",
)
def test_o2_ema_weights_saved_inside_the_swap_are_the_emas(tmp_path: Path) -> None:
    saved, ema = _ema_export("O2", tmp_path)
    assert all(torch.equal(saved[k], ema[k]) for k in ema)


def test_o2_ema_save_pretrained_is_the_fp32_ema(tmp_path: Path) -> None:
    """The recipe for the EMA's export at O2: ``ema_model.save_pretrained`` (an FP32 UNet from the config) writes
    the FP32 EMA exactly, and ``from_pretrained`` loads it."""
    run = _unconditional("O2")
    _train(run, list(run.loader)[:4], _unconditional_loss)
    names = [n for n, _ in run.accelerator.unwrap_model(run.unet).named_parameters()]
    run.ema.save_pretrained(tmp_path)
    ema = _ema_weights(run.ema, names)
    loaded = UNet2DModel.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], ema[k]) for k in ema)


@pytest.mark.parametrize("level", LEVELS)
def test_float16_overflow_skips_the_step_as_fp32_without_it(level: str) -> None:
    """float16 (tiny): an initial scale of 2**20 overflows the first steps, which are skipped (the weights, the
    Adam state and the LR schedule stay), the scale backs off, and the run trains as FP32 does with those steps
    left out; the EMA steps on every synchronised step, as the script does."""
    run = _unconditional(level, 16, half_dtype=torch.float16, init_scale=2.0**20, gradient_accumulation_steps=2)
    batches = list(run.loader)
    _train(run, batches, _unconditional_loss)
    assert run.skipped[0] and not run.skipped[-1], run.skipped
    metrics = run.accelerator.mpx_metrics()
    assert metrics["mpx/skipped_steps"] == sum(run.skipped) and metrics["mpx/loss_scale"] == 2.0**18
    assert run.lr_scheduler.scheduler.last_epoch == len(run.skipped) - sum(run.skipped)

    reference = _unconditional("no", 16, gradient_accumulation_steps=2)
    batches = list(reference.loader)
    real = iter([not s for s in run.skipped])
    for i, batch in enumerate(batches):  # FP32, the same batches, the skipped steps left out
        with reference.accelerator.accumulate(reference.unet):
            loss = _unconditional_loss(reference, batch)
            reference.accelerator.backward(loss)
            if reference.accelerator.sync_gradients and next(real):
                reference.accelerator.clip_grad_norm_(reference.unet.parameters(), 1.0)
                reference.optimizer.step()
                reference.lr_scheduler.step()
            reference.optimizer.zero_grad()
    start = {k: v.float() for k, v in _unconditional_unet().state_dict().items()}
    assert _relative(_fp32_weights(run), _fp32_weights(reference), start) < 0.2


# -- train_text_to_image_lora.py -----------------------------------------------------------------------------------
def _text_to_image_lora(mode: str, hooks: bool = True) -> tuple[_Run, list[torch.Tensor]]:
    """``train_text_to_image_lora.py``'s set-up: everything frozen and cast to ``weight_dtype`` (the UNet too), a
    LoRA added with ``unet.add_adapter``, ``cast_training_params`` to FP32, only the LoRA parameters in the
    optimizer, and its checkpoint hooks (``save_lora_weights`` with ``weights.pop()``; ``lora_state_dict`` and
    ``set_peft_model_state_dict`` back into the prepared UNet)."""
    from diffusers import StableDiffusionPipeline
    from diffusers.training_utils import cast_training_params
    from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    accelerator = _accelerator(mode, gradient_accumulation_steps=2)
    set_seed(0)
    text_encoder, vae, unet = _text_encoder(), _vae(), _unet()
    unet.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    weight_dtype = _weight_dtype(accelerator)
    unet.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    torch.manual_seed(4)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))  # fmt: skip
    cast_training_params(unet, dtype=torch.float32)

    def save_model_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if accelerator.is_main_process:
            layers = None
            for model in models:
                layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(accelerator.unwrap_model(model)))
                weights.pop()
            StableDiffusionPipeline.save_lora_weights(output_dir, unet_lora_layers=layers, safe_serialization=True)

    def load_model_hook(models: list[Any], input_dir: str) -> None:
        unet_ = models.pop()
        lora_state_dict, _ = StableDiffusionPipeline.lora_state_dict(input_dir)
        state = {k.replace("unet.", ""): v for k, v in lora_state_dict.items() if k.startswith("unet.")}
        incompatible = set_peft_model_state_dict(unet_, convert_unet_state_dict_to_peft(state), adapter_name="default")
        assert not getattr(incompatible, "unexpected_keys", None)
        if accelerator.mixed_precision == "fp16":  # the script's condition: not at an opt level
            cast_training_params([unet_], dtype=torch.float32)

    if hooks:
        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)
    lora_layers = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_layers, lr=10 * LR)
    loader = torch.utils.data.DataLoader(_images(), batch_size=2)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)
    run = _Run(accelerator, unet, optimizer, loader, lr_scheduler, None, vae, text_encoder, weight_dtype=weight_dtype)
    return run, lora_layers


def _lora_export(run: _Run) -> dict[str, torch.Tensor]:
    """The script's final export: ``unet.to(torch.float32)``, then the LoRA layers of the unwrapped UNet."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    unet = run.unet.to(torch.float32)
    return convert_state_dict_to_diffusers(get_peft_model_state_dict(run.accelerator.unwrap_model(unet)))


@pytest.fixture(scope="module")
def lora_references() -> dict[str, dict[str, torch.Tensor]]:
    """The LoRA script's export after 3 steps under ``"no"`` (FP32) and ``"bf16"``, and before any (``"initial"``)."""
    from tests.accelerate_helpers import accelerate_state_reset

    out = {}
    with accelerate_state_reset():
        start, _ = _text_to_image_lora("no", hooks=False)
        out["initial"] = {k: v.float() for k, v in _lora_export(start).items()}
        for mode in ("no", "bf16"):
            run, _ = _text_to_image_lora(mode, hooks=False)
            _train(run, run.loader)
            out[mode] = {k: v.float() for k, v in _lora_export(run).items()}
    return out


@pytest.mark.parametrize("level", LEVELS)
def test_lora_trains_as_bf16_exports_fp32_and_resumes(
    level: str, lora_references: dict[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """Only the LoRA parameters train (the half base stays as it was), the FP32 export after ``unet.to(float32)``
    holds the FP32 LoRA training produced (the masters at O2) and lies within bfloat16's tolerance of ``"bf16"``'s
    and FP32's, and the script's hooks resume 2 steps into the bits of the 3 uninterrupted ones."""
    run, lora_layers = _text_to_image_lora(level)
    unet = run.accelerator.unwrap_model(run.unet)
    base = {n: p.detach().clone() for n, p in unet.named_parameters() if not p.requires_grad}
    assert base and all(v.dtype == HALF for v in base.values())
    assert {p.dtype for p in lora_layers} == {HALF if level == "O2" else torch.float32}
    batches = list(run.loader)
    _train(run, batches[:4])
    run.accelerator.save_state(str(tmp_path / "checkpoint-2"))
    assert (tmp_path / "checkpoint-2" / "pytorch_lora_weights.safetensors").exists()
    _train(run, batches[4:])
    assert all(torch.equal(p, base[n]) for n, p in unet.named_parameters() if n in base)
    trained = {k: v.detach().float().clone() for k, v in run.accelerator.get_state_dict(run.unet).items()
               if "lora" in k}  # fmt: skip
    exported = _lora_export(run)
    assert {v.dtype for v in exported.values()} == {torch.float32}
    assert sorted(v.float().sum().item() for v in exported.values()) == sorted(
        v.sum().item() for v in trained.values()
    )  # the masters themselves (names differ: diffusers' format)
    for mode in ("no", "bf16"):
        ref, initial = lora_references[mode], lora_references["initial"]
        assert _relative({k: v.float() for k, v in exported.items()}, ref, initial) < 0.2, mode

    resumed, _ = _text_to_image_lora(level)
    rest = list(resumed.loader)[4:]
    resumed.accelerator.load_state(str(tmp_path / "checkpoint-2"))
    _train(resumed, rest)
    assert resumed.losses == run.losses[4:]
    got = {k: v.float() for k, v in _lora_export(resumed).items()}
    assert all(torch.equal(got[k], exported[k].float()) for k in exported)


@pytest.mark.parametrize("where", ["clip", "step"])
def test_o2_cast_training_params_after_prepare_is_refused_naming_it(where: str) -> None:
    """``cast_training_params(unet, torch.float32)`` after ``prepare`` at O2 (the LoRA script's load hook, ported
    with its condition widened to the opt level) makes the LoRA parameters FP32, which takes their masters out of
    the engine: the next ``clip_grad_norm_`` (before any step) or step (after one) is refused naming
    ``cast_training_params`` and the fix; the message spoke only of another engine that prepared the model since
    (and told to step through it)."""
    from diffusers.training_utils import cast_training_params

    run, lora_layers = _text_to_image_lora("O2", hooks=False)
    batches = list(run.loader)
    if where == "step":
        _train(run, batches[:2], max_grad_norm=float("inf"))
    cast_training_params(run.accelerator.unwrap_model(run.unet), dtype=torch.float32)
    assert {p.dtype for p in lora_layers} == {torch.float32}
    with pytest.raises(RuntimeError, match=r"cast_training_params\(model, dtype=torch.float32\)") as info:
        if where == "clip":
            _train(run, batches[:2])
        else:
            with run.accelerator.accumulate(run.unet):
                run.accelerator.backward(_text_to_image_loss(run, batches[2]))
            with run.accelerator.accumulate(run.unet):
                run.accelerator.backward(_text_to_image_loss(run, batches[3]))
                run.optimizer.step()
    assert "cast_training_params before the model is prepared" in str(info.value)
    assert "lora_" in str(info.value)
