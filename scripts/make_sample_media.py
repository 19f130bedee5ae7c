"""Write vlbatch's deterministic sample images and videos: `python3 scripts/make_sample_media.py OUT`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlbatch.devtools.samples import main  # noqa: E402

if __name__ == "__main__":
    main()
