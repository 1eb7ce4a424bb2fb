"""The MCP server, its backends, file edits and the workspace it may touch."""
