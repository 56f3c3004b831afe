"""Wire models of the public APIs (pydantic), one module per protocol."""
