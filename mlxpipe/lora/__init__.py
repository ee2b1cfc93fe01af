"""``mlxpipe lora``: pipeline-parallel LoRA fine-tuning (the controller side; a rank's side is
``worker.training``)."""
