"""The experiment over training seeds: statistics (``stats``), the report (``report``) and the
per-seed runs that reuse Steps 1-4's domain functions (``runs``)."""
