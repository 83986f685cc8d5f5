"""The engine of a run (:class:`~lightning_mpx.engine.amp.Amp`): its lifecycle, the step, overflow outcomes, FSDP
shards."""
