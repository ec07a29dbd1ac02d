"""The kernel interface is stated once (pagoda/executor/kernels/abi.py) and matches the C
header: every prototype of csrc/kernels.h has that signature in abi.SIGNATURES and nothing
else is there, every struct of it its field-for-field mirror in abi.STRUCTS and no other
mirror is there, and the FORMAT_* / KV_* codes are abi's enums."""

from __future__ import annotations

import ctypes
import re

from pagoda.executor.kernels import abi
from pagoda.executor.kernels.build import SOURCE_DIR, load_cpu_kernels
from pagoda.executor.kernels.packed_weight import PLANE_NAMES

C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "void": None}


def header() -> str:
    """kernels.h without its comments."""
    return re.sub(r"/\*.*?\*/", "", (SOURCE_DIR / "kernels.h").read_text(), flags=re.DOTALL)


def prototypes() -> dict[str, tuple[type | None, list[type]]]:
    """name -> (restype, argtypes) of each `pagoda_*` prototype: a pointer to one of
    abi.STRUCTS is a pointer to its mirror, any other pointer a void pointer to ctypes."""
    found = {}
    for restype, name, params in re.findall(r"\b(void|int)\s+(pagoda_\w+)\s*\(([^)]*)\)\s*;",
                                            header()):
        argtypes = []
        for param in params.split(","):
            param = param.strip()
            if param in ("void", ""):
                continue
            struct = re.match(r"(?:const\s+)?struct\s+(\w+)\s*\*", param)
            if struct and struct[1] in abi.STRUCTS:
                argtypes.append(ctypes.POINTER(abi.STRUCTS[struct[1]]))
            elif "*" in param:
                argtypes.append(ctypes.c_void_p)
            else:
                argtypes.append(C_TYPES[param.replace("const ", "").split()[0]])
        found[name] = (C_TYPES[restype], argtypes)
    return found


def defines() -> dict[str, int]:
    """name -> value of each integer `#define` of the header."""
    return {name: int(value) for name, value in
            re.findall(r"^#define\s+(\w+)\s+(\d+)\b", header(), flags=re.MULTILINE)}


def field_type(declaration: str, sizes: dict[str, int]) -> tuple[str, type]:
    """(name, ctypes type) of one field declaration: a struct of abi.STRUCTS (a pointer to
    one, an array of them, sized by a number or a #define) is its mirror, any other pointer
    a void pointer."""
    match = re.fullmatch(r"(?:const\s+)?(?:struct\s+(\w+)|(\w+))\s*(\*?)\s*(\w+)"
                         r"\s*(?:\[\s*(\w+)\s*\])?", declaration)
    assert match, f"one field a declaration: {declaration!r}"
    tag, scalar, pointer, name, length = match.groups()
    if tag is not None:
        assert tag in abi.STRUCTS, f"struct {tag} has no mirror in abi.STRUCTS"
        kind = abi.STRUCTS[tag]
        kind = ctypes.POINTER(kind) if pointer else kind
    else:
        kind = ctypes.c_void_p if pointer else C_TYPES[scalar]
    if length is not None:
        kind = kind * (int(length) if length.isdigit() else sizes[length])
    return name, kind


def structs() -> dict[str, list[tuple[str, type]]]:
    """tag -> [(field, ctypes type)] of each `struct pagoda_* { ... };` of the header, one
    field a declaration (field_type)."""
    sizes = defines()
    return {tag: [field_type(declaration.strip(), sizes) for declaration in body.split(";")
                  if declaration.strip()]
            for tag, body in re.findall(r"\bstruct\s+(pagoda_\w+)\s*\{([^}]*)\}\s*;",
                                        header())}


def test_every_struct_is_mirrored_field_for_field() -> None:
    declared = structs()
    assert {"pagoda_attention_args", "pagoda_decoder"} <= set(declared)  # the parser read it
    # both ways: every struct of the header has a mirror and every mirror its struct
    assert declared == {tag: list(mirror._fields_) for tag, mirror in abi.STRUCTS.items()}
    assert defines()["MAX_SEGMENTS"] == abi.MAX_SEGMENTS
    assert defines()["MAX_LORA_PARTS"] == abi.MAX_LORA_PARTS
    assert defines()["MAX_EXPERT_GROUPS"] == abi.MAX_EXPERT_GROUPS
    assert {f"MOE_{name.upper()}": value for name, value in abi.MOE_ROUTINGS.items()} == {
        name: value for name, value in defines().items() if name.startswith("MOE_")}


def test_structs_live_in_the_header_alone() -> None:
    """No source defines a struct of its own that Python fills: each is kernels.h's."""
    for source in sorted(SOURCE_DIR.glob("*.[ch]")):
        if source.name != "kernels.h":
            text = source.read_text()
            assert not re.search(r"\bstruct\s+pagoda_\w+\s*\{", text), source.name


def test_a_decoder_segment_has_the_packed_planes() -> None:
    """whole_stack_decode.py sets a segment's planes by PLANE_NAMES."""
    names = [name for name, _ in abi.DecoderSegment._fields_]
    assert names == ["format", "out_features", *PLANE_NAMES]


def test_every_prototype_has_its_signature_and_only_those() -> None:
    declared = prototypes()
    assert len(declared) >= 15  # the parser really read the header
    assert declared == abi.SIGNATURES


def test_the_format_codes_are_the_headers() -> None:
    defines = dict(re.findall(r"#define\s+(FORMAT_\w+|KV_\w+|LORA_\w+)\s+(\d+)", header()))
    assert {f"FORMAT_{f.name}": f.value for f in abi.WeightFormat} == {
        k: int(v) for k, v in defines.items() if k.startswith("FORMAT_")}
    assert {f"KV_{f.name}": f.value for f in abi.KVCacheFormat} == {
        k: int(v) for k, v in defines.items() if k.startswith("KV_")}
    assert {f"LORA_{f.name}": f.value for f in abi.LoRADtype} == {
        k: int(v) for k, v in defines.items() if k.startswith("LORA_")}
    assert abi.weight_format("q6k") == 5 and abi.kv_cache_format("fp8_e5m2") == 2


def test_the_loaded_library_carries_the_table() -> None:
    lib = load_cpu_kernels()
    for name, (restype, argtypes) in abi.SIGNATURES.items():
        if name in abi.BF16_ENTRIES and not lib.pagoda_bf16_kernels_available():
            continue
        function = getattr(lib, name)
        assert (function.restype, list(function.argtypes)) == (restype, argtypes), name
