"""What a saved chunk package holds, read from its spec (works on Linux): per
function, the inputs, states and outputs with shapes and dtypes, and the ops
of the converted MIL program (after coremltools' graph passes)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import coremltools as ct
from coremltools.proto import MIL_pb2


@dataclass
class FunctionSummary:
    name: str
    opset: str
    inputs: dict = field(default_factory=dict)  # name -> (shape, dtype name)
    states: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    ops: Counter = field(default_factory=Counter)  # op type -> count
    value_dtypes: Counter = field(default_factory=Counter)  # dtype of every op output -> count


def _tensor(t) -> tuple:
    shape = tuple(int(d.constant.size) for d in t.dimensions)
    return shape, MIL_pb2.DataType.Name(t.dataType)


def _summarize(name: str, fn) -> FunctionSummary:
    out = FunctionSummary(name, fn.opset)
    for arg in fn.inputs:
        if arg.type.HasField("stateType"):
            out.states[arg.name] = _tensor(arg.type.stateType.wrappedType.tensorType)
        else:
            out.inputs[arg.name] = _tensor(arg.type.tensorType)
    block = fn.block_specializations[fn.opset]
    types_of = {}
    for op in block.operations:
        out.ops[op.type] += 1
        for o in op.outputs:
            if o.type.HasField("tensorType"):
                types_of[o.name] = o.type.tensorType
                if op.type != "const":
                    out.value_dtypes[MIL_pb2.DataType.Name(o.type.tensorType.dataType)] += 1
    for o in block.outputs:
        out.outputs[o] = _tensor(types_of[o])
    return out


def package_functions(path) -> dict[str, FunctionSummary]:
    """Every function of the .mlpackage at `path` (one named "main" for a
    single-function package)."""
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    return {name: _summarize(name, fn) for name, fn in spec.mlProgram.functions.items()}


def default_function(path) -> str:
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    return spec.description.defaultFunctionName or "main"
