"""The server's routes, one APIRouter per concern (build_app in server.py includes them):
generation.py (completions, chat, responses, embeddings, tokenize), models.py (list, load,
unload models), lora.py (load and unload LoRA adapters), admin.py (health, version,
metrics); common.py holds what they share (the state dependencies, model resolution)."""
