"""kvctl: experiments, pushes, status and test harnesses for kvwire daemons."""
