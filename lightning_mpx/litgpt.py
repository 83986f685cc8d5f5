"""Public import path of litgpt's entry points with an opt level: the code lives in
:mod:`lightning_mpx.integrations.litgpt`. ``python -m lightning_mpx.litgpt finetune_lora <checkpoint_dir> --opt_level
O2 [litgpt's flags]`` (or ``finetune_full``; ``pretrain <model_name>``) runs them from the command line."""

from lightning_mpx.integrations.litgpt import finetune_full, finetune_lora, main, pretrain  # noqa: F401

__all__ = ["finetune_full", "finetune_lora", "main", "pretrain"]

if __name__ == "__main__":
    main()
