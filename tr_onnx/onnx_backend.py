"""tr_onnx as an ``onnx.backend.base.Backend``, so ONNX's own backend test suite can run it.

Sequence inputs and outputs (lists of tensors) are the adapter's: a plan holds tensors. A list
given for a sequence input becomes one tensor input per element and a SequenceConstruct of
them (a model per list length); a sequence output is resolved at specialisation into one plan
output per element (``passes.control_flow``), read back here as a list.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep

from .feeds import check_feed
from .passes.control_flow import output_value
from .session import InferenceSession


def _is_sequence(vi: onnx.ValueInfoProto) -> bool:
    return vi.type.HasField("sequence_type")


def _is_listed(vi: onnx.ValueInfoProto) -> bool:
    """A sequence or an optional: given as a list, an array or None, not as one tensor."""
    return vi.type.HasField("sequence_type") or vi.type.HasField("optional_type")


class TrOnnxRep(BackendRep):
    def __init__(self, session: InferenceSession):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feed = inputs
        else:
            inputs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            feed = dict(zip(self.input_names, inputs))
        return tuple(self.session.run(None, {k: np.asarray(v) for k, v in feed.items()}))


class SequenceRep(BackendRep):
    """A model with sequence inputs or outputs, or optional inputs: one session per list
    length (and per optional given or not) of its inputs. An optional input given becomes an
    Optional node of what it holds, one given as None an empty Optional node."""

    def __init__(self, model: onnx.ModelProto, **kwargs):
        self.model = model
        self.kwargs = kwargs
        self.input_names = [i.name for i in model.graph.input]
        self.sessions: dict[tuple, InferenceSession] = {}

    def _session(self, lengths: dict[str, int], feed: dict) -> InferenceSession:
        key = tuple(sorted(lengths.items(), key=lambda kv: kv[0]))
        if key not in self.sessions:
            model = onnx.ModelProto()
            model.CopyFrom(self.model)
            g = model.graph
            inputs, front = [], []
            for vi in g.input:
                if vi.name not in lengths:
                    inputs.append(vi)
                    continue
                tp, name, wrap = vi.type, vi.name, []
                if tp.HasField("optional_type"):
                    if lengths[name] is None:
                        front.append(helper.make_node("Optional", [], [name],
                                                      type=tp.optional_type.elem_type))
                        continue
                    tp, name = tp.optional_type.elem_type, f"{name}[held]"
                    wrap = [helper.make_node("Optional", [name], [vi.name])]
                if tp.HasField("tensor_type"):
                    inputs.append(helper.make_tensor_value_info(
                        name, tp.tensor_type.elem_type, feed[name].shape))
                    front += wrap
                    continue
                elem = tp.sequence_type.elem_type.tensor_type.elem_type
                names = [f"{name}[{i}]" for i in range(lengths[vi.name])]
                inputs += [helper.make_tensor_value_info(n, elem, feed[n].shape) for n in names]
                front.append(helper.make_node("SequenceConstruct", names, [name]) if names
                             else helper.make_node("SequenceEmpty", [], [name], dtype=elem))
                front += wrap
            del g.input[:]
            g.input.extend(inputs)
            nodes = front + list(g.node)
            del g.node[:]
            g.node.extend(nodes)
            self.sessions[key] = InferenceSession(model, backend="numpy",
                                                  channel_align=self.kwargs.get("channel_align"))
        return self.sessions[key]

    def run(self, inputs, **kwargs):
        given = inputs if isinstance(inputs, dict) else dict(zip(self.input_names, inputs))
        lengths, flat = {}, {}
        for vi in self.model.graph.input:
            value, name = given.get(vi.name), vi.name
            if vi.type.HasField("optional_type"):
                if value is None:
                    lengths[name] = None
                    continue
                name = f"{name}[held]"
                if not isinstance(value, list):
                    lengths[vi.name], flat[name] = -1, np.asarray(value)
                    continue
            if isinstance(value, list):
                lengths[vi.name] = len(value)
                flat.update({f"{name}[{i}]": np.asarray(x) for i, x in enumerate(value)})
            else:
                flat[name] = np.asarray(value)
        session = self._session(lengths, flat)
        feed = check_feed(flat, session.imported.inputs)
        plan = session.plan_for(feed)
        for name, x in feed.items():
            if name not in session.imported.const_feeds:
                plan.executor.write_input(name, x)
        plan.executor.run()
        names = [v.name for v in plan.graph.outputs]
        return tuple(output_value(plan.executor.read_output, vi.name, vi.type, names)
                     for vi in self.model.graph.output)



class TrOnnxBackend(Backend):
    """``channel_align`` may be passed to ``prepare`` to run the suite with padded channels."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> BackendRep:
        super().prepare(model, device, **kwargs)
        if any(_is_listed(vi) for vi in list(model.graph.input) + list(model.graph.output)):
            return SequenceRep(model, **kwargs)
        return TrOnnxRep(InferenceSession(model, backend="numpy",
                                          channel_align=kwargs.get("channel_align")))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"
