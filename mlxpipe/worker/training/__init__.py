"""A training rank (``mlxpipe lora``): LoRA fine-tuning of the rank's layers, the backward across the stages.

The model is loaded and cut into stages exactly as for generation; the rank's
layers are frozen and given LoRA parameters and an optimizer exactly as
single-process mlx_lm.lora gives them (``tuner``). The rank answers the
controller's ``resume``, ``step``, ``eval`` and ``save`` (``train``), running
each batch's micro-batches forward and backward in the order of a pipeline
schedule that cannot deadlock (``train_schedule``: GPipe or 1F1B, pure).

The rooms: ``train`` (the training rank's loop and its stage), ``tuner`` (the
LoRA parameters, the optimizer, gradient checkpointing) and ``train_schedule``
(which micro-batch each stage runs when).
"""
