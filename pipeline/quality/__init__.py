"""Data quality: great-expectations suites generated from schemas/.

``suites.py`` is the pure part (expectation specs from a table spec);
``gx.py`` is the one module importing great_expectations."""
