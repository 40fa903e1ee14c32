"""trainer/elastic"""
