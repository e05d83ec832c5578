import sys
from pathlib import Path

# tests import their shared fixtures as `from tests.helpers import ...`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
