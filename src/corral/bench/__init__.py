"""`corral bench`: a load generator for any OpenAI-compatible URL (`loadgen.py`) and what it
writes (`report.py`: a CSV per point, a JSON manifest, plots)."""
