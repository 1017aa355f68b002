import sys
from pathlib import Path

# tests import their helper modules (node_suite, ...) and the repo's model_zoo package
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
