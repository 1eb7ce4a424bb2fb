"""Who proposes tokens: the drafter interface, context lookup, trained heads, the mode that picks one."""
