"""What people read: one verdict as a page (`verdict_page.py`) and a property search's report
(`search_report.py`)."""
