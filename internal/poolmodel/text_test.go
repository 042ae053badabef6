package poolmodel

import (
	"errors"
	"strconv"
)

var errBadLine = errors.New("want ID START END")

func atoi(s string) (int, error)    { return strconv.Atoi(s) }
func atou(s string) (uint64, error) { return strconv.ParseUint(s, 10, 64) }
func itoa(n int) string             { return strconv.Itoa(n) }
func utoa(n uint64) string          { return strconv.FormatUint(n, 10) }
