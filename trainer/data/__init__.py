"""trainer/data"""
