"""Configuring agents and editors: the clients known, config files edited in place."""
