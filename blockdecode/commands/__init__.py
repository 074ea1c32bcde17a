"""The `blockdecode` command's commands, each parser beside its handler; `blockdecode.cli` is their table."""
