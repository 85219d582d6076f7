"""The GPU check (issue 28): `make gpu-wheels`, `make gpu-check`, and its dry run in `make test`."""
