"""Configuration snippets and hooks for agents and editors."""
