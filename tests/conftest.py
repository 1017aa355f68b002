import sys
from pathlib import Path

import pytest

from tr_onnx.importer import internal_ops_allowed

# tests import their helper modules (node_suite, ...) and the repo's model_zoo package
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))


@pytest.fixture(autouse=True)
def _internal_ops(request):
    """A test marked ``internal_ops`` builds models holding tr_onnx's internal ops (to check
    their kernels and gradients), which a user's model may not hold."""
    if request.node.get_closest_marker("internal_ops") is None:
        yield
        return
    with internal_ops_allowed():
        yield
