"""LoRA adapters served over one base model (issue 35): what a request names
(request.py) and what an adapter's files hold (adapter_files.py). No torch here: the
weights are loaded and multiplied in pagoda/executor/lora/."""
