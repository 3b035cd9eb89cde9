"""tools/check-ptxas.py: parsing of ptxas -v output (no nvcc needed)."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "check_ptxas", os.path.join(os.path.dirname(__file__), "..", "..", "tools", "check-ptxas.py"))
check_ptxas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_ptxas)

# Shaped like real `nvcc -Xptxas=-v,--warn-on-spills` output (two kernels, one with C7512).
_LOG = """\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function '_Z7kernelAv'
ptxas warning : Registers are spilled to local memory in function '_Z7kernelAv', 96 bytes spill stores, 284 bytes spill loads
ptxas info    : Compiling entry function '_Z7kernelAv' for 'sm_90a'
ptxas info    : Function properties for _Z7kernelAv
    56 bytes stack frame, 96 bytes spill stores, 284 bytes spill loads
ptxas info    : Used 168 registers, used 6 barriers, 56 bytes cumulative stack size
ptxas info    : Compiling entry function '_Z7kernelBv' for 'sm_90a'
ptxas info    : Function properties for _Z7kernelBv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 123 registers, used 16 barriers
ptxas info    : (C7519) warpgroup.arrive is injected in around line 10 by compiler to allow use of registers in GMMA in function '_Z7kernelBv'
"""


def test_parse_registers_spills_and_notes():
    k = check_ptxas.parse(_LOG)
    assert set(k) == {"_Z7kernelAv", "_Z7kernelBv"}
    a, b = k["_Z7kernelAv"], k["_Z7kernelBv"]
    assert (a["regs"], a["stack"], a["spill_st"], a["spill_ld"]) == (168, 56, 96, 284)
    assert a["notes"] == {"C7512"}
    assert (b["regs"], b["stack"], b["spill_st"], b["spill_ld"]) == (123, 0, 0, 0)
    assert b["notes"] == {"C7519"}


# A kernel that calls a non-inlined device function: ptxas lists the function's properties after the kernel's.
_LOG_CALL = """\
ptxas warning : Registers are spilled to local memory in function '_Z7kernelCv', 40 bytes spill stores, 56 bytes spill loads
ptxas info    : Compiling entry function '_Z7kernelCv' for 'sm_90a'
ptxas info    : Function properties for _Z7kernelCv
    176 bytes stack frame, 40 bytes spill stores, 56 bytes spill loads
ptxas info    : Function properties for _Z6helperRA32_f
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 176 bytes cumulative stack size
"""


def test_a_called_functions_figures_are_not_the_kernels():
    k = check_ptxas.parse(_LOG_CALL)
    assert set(k) == {"_Z7kernelCv"}
    c = k["_Z7kernelCv"]
    assert (c["regs"], c["stack"], c["spill_st"], c["spill_ld"]) == (168, 176, 40, 56)


def test_demangled_names_drop_namespaces_and_parameters():
    names = check_ptxas.demangle(["_ZN8flashmla4sm902ns6kernelILi576EEEvi"])
    (pretty,) = names.values()
    assert "flashmla::sm90::" not in pretty and "(" not in pretty
