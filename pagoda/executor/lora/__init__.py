"""LoRA adapters in the execution layer (issue 35): their weights loaded as tensors
(adapter_weights.py), fused per Pagoda module (fused.py), added to the base layers' outputs
by forward hooks (model_lora.py) for the rows the step's mapping gives them (step.py),
loaded and slotted by the runner's manager (manager.py). Never merged into the base
weights."""
