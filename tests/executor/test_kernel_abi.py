"""The kernel interface is stated once (pagoda/executor/kernels/abi.py) and matches the C
header: every prototype of csrc/kernels.h has that signature in abi.SIGNATURES and nothing
else is there, and the FORMAT_* / KV_* codes are abi's enums."""

from __future__ import annotations

import ctypes
import re

from pagoda.executor.kernels import abi
from pagoda.executor.kernels.build import SOURCE_DIR, load_cpu_kernels

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


def structs() -> dict[str, list[tuple[str, type]]]:
    """tag -> [(field, ctypes type)] of each `struct pagoda_* { ... };` of the header, one
    field a declaration (any pointer a void pointer)."""
    found = {}
    for tag, body in re.findall(r"\bstruct\s+(pagoda_\w+)\s*\{([^}]*)\}\s*;", header()):
        fields = []
        for declaration in body.split(";"):
            declaration = declaration.strip()
            if not declaration:
                continue
            assert "," not in declaration and "[" not in declaration, declaration
            name = re.search(r"(\w+)$", declaration)[1]
            if "*" in declaration:
                fields.append((name, ctypes.c_void_p))
            else:
                fields.append((name, C_TYPES[declaration.replace("const ", "").split()[0]]))
        found[tag] = fields
    return found


def test_every_parameter_struct_is_mirrored_field_for_field() -> None:
    declared = structs()
    assert "pagoda_attention_args" in declared  # the parser really read the header
    assert declared == {tag: list(mirror._fields_) for tag, mirror in abi.STRUCTS.items()}


def test_every_prototype_has_its_signature_and_only_those() -> None:
    declared = prototypes()
    assert len(declared) >= 15  # the parser really read the header
    assert declared == abi.SIGNATURES


def test_the_format_codes_are_the_headers() -> None:
    defines = dict(re.findall(r"#define\s+(FORMAT_\w+|KV_\w+)\s+(\d+)", header()))
    assert {f"FORMAT_{f.name}": f.value for f in abi.WeightFormat} == {
        k: int(v) for k, v in defines.items() if k.startswith("FORMAT_")}
    assert {f"KV_{f.name}": f.value for f in abi.KVCacheFormat} == {
        k: int(v) for k, v in defines.items() if k.startswith("KV_")}
    assert abi.weight_format("q6k") == 5 and abi.kv_cache_format("fp8_e5m2") == 2


def test_the_loaded_library_carries_the_table() -> None:
    lib = load_cpu_kernels()
    for name, (restype, argtypes) in abi.SIGNATURES.items():
        if name in abi.BF16_ENTRIES and not lib.pagoda_bf16_kernels_available():
            continue
        function = getattr(lib, name)
        assert (function.restype, list(function.argtypes)) == (restype, argtypes), name
