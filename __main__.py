"""`python -m hf_blockwise.tools.cli ...`: the `hf-blockwise` console script (e.g. under `accelerate launch -m`)."""

from hf_blockwise.tools.cli import main

raise SystemExit(main())
