"""The front doors: Lightning Trainer and Fabric plugins, the Accelerate adapter, FSDP support."""
