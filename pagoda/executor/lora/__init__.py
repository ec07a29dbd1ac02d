"""LoRA adapters in the execution layer (issue 35): their weights loaded as tensors
(adapter_weights.py) and the forward that adds them to the base projections."""
