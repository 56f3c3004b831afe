"""Migration scripts, one per schema revision (a package so that installs ship them)."""
