"""python -m vlbatch.pipeline.config --schema [PATH]: write the job config's JSON schema (default configs/)."""
from __future__ import annotations

import argparse

from vlbatch.pipeline.config.load import export_schema
from vlbatch.pipeline.config.schema import SCHEMA_PATH

ap = argparse.ArgumentParser(description="job config tools")
ap.add_argument("--schema", nargs="?", const=str(SCHEMA_PATH), help="write the JSON schema (default configs/)")
args = ap.parse_args()
if args.schema:
    print(export_schema(args.schema))
