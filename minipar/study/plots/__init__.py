"""The chapters' figures, one module per chapter's package (plotly figures from measured or planned numbers)."""
