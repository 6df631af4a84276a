"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) compiled with llguidance into token masks."""
