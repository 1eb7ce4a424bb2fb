"""mlx-dspark agent bridge: HTTP APIs, MCP server and CLI on top of `engine`."""
