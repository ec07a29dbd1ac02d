"""Random PEFT LoRA adapters of the bundled model's shapes, as `peft` saves them: rank R
(default 16) on all seven linear projections of every layer, B non-zero (speed depends on
shapes, not values). For issue 35's goals (benchmarks/lora_serving.sh).

    .venv/bin/python benchmarks/lora_adapters.py OUT_DIR [--count 4] [--rank 16]
        [--dtype bfloat16|float32]

writes OUT_DIR/adapter-0 ... adapter-{count-1} and prints each folder's size. The tensors
are saved in --dtype, default bfloat16: adapters trained in bf16 are usually saved so
(peft keeps the trained model's dtype), and Pagoda's --lora-dtype auto then serves them in
bfloat16 (half float32's bytes read per token); --dtype float32 for the float32 case.
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, LlamaForCausalLM

from pagoda.executor.loader.model_files import bundled_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the saved tensors' dtype (default bfloat16, as adapters "
                             "trained in bf16 are usually saved)")
    args = parser.parse_args()
    gguf = bundled_model_path()
    config = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    base = LlamaForCausalLM(config)  # random weights: only the adapter is saved
    for index in range(args.count):
        torch.manual_seed(index)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                          init_lora_weights=False, task_type="CAUSAL_LM")
        model = get_peft_model(base, lora, adapter_name=f"adapter-{index}")
        with torch.no_grad():  # the adapter's tensors alone (the random base is not saved)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(getattr(torch, args.dtype))
        folder = os.path.join(args.out_dir, f"adapter-{index}")
        model.save_pretrained(args.out_dir, selected_adapters=[f"adapter-{index}"])
        model = model.unload()
        base = model
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"{folder}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
