"""The data model's parts, behind their face :mod:`gradscope.recording`: the rows of a recording's
tables (``rows``), the table that holds them as columns (``table``) and the recording's file
(``files``)."""
