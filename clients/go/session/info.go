package session

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"strconv"
	"strings"

	"google.golang.org/protobuf/types/known/structpb"

	pb "openenvgrpc/gen/openenv_grpc/v1"
)

// Info returns a result's info as Go values with the env's types kept: an int is an int64
// (a *big.Int beyond int64), a float a float64, a bool, a string, nil, and nested
// map[string]any and []any. Sessions opened by Open ask for the info as JSON text
// (openenv-info: json); a server that predates it, or an info holding NaN or an infinity
// (which JSON cannot write), sends a google.protobuf.Struct instead, whose numbers are all
// float64. It returns an error when the JSON text is not a JSON object.
func Info(result *pb.StepResult) (map[string]any, error) {
	if text := result.GetInfoJson(); text != "" {
		return DecodeInfoJSON(text)
	}
	return structToMap(result.GetInfo()), nil
}

// structToMap is s as Go values, NaN and infinities kept as float64 (structpb's AsMap
// turns them into strings).
func structToMap(s *structpb.Struct) map[string]any {
	out := make(map[string]any, len(s.GetFields()))
	for key, value := range s.GetFields() {
		out[key] = valueToGo(value)
	}
	return out
}

func valueToGo(v *structpb.Value) any {
	switch kind := v.GetKind().(type) {
	case *structpb.Value_NumberValue:
		return kind.NumberValue
	case *structpb.Value_StringValue:
		return kind.StringValue
	case *structpb.Value_BoolValue:
		return kind.BoolValue
	case *structpb.Value_StructValue:
		return structToMap(kind.StructValue)
	case *structpb.Value_ListValue:
		values := kind.ListValue.GetValues()
		out := make([]any, len(values))
		for i, item := range values {
			out[i] = valueToGo(item)
		}
		return out
	}
	return nil
}

// DecodeInfoJSON decodes an info_json text as Info describes, or returns an error when the
// text is not one JSON object.
func DecodeInfoJSON(text string) (map[string]any, error) {
	decoder := json.NewDecoder(strings.NewReader(text))
	decoder.UseNumber() // numbers as their text: nothing rounded through float64
	var info map[string]any
	if err := decoder.Decode(&info); err != nil {
		return nil, fmt.Errorf("info_json: %w", err)
	}
	if _, err := decoder.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("info_json: more than one JSON value")
	}
	if info == nil {
		return nil, errors.New("info_json: null, not an object")
	}
	return typed(info).(map[string]any), nil
}

// typed replaces every json.Number in v with an int64, a *big.Int or a float64.
func typed(v any) any {
	switch v := v.(type) {
	case json.Number:
		text := string(v)
		if !strings.ContainsAny(text, ".eE") {
			if n, err := strconv.ParseInt(text, 10, 64); err == nil {
				return n
			}
			if n, ok := new(big.Int).SetString(text, 10); ok {
				return n
			}
		}
		f, _ := strconv.ParseFloat(text, 64) // out of range: ±Inf, as JSON.parse gives
		return f
	case map[string]any:
		for key, item := range v {
			v[key] = typed(item)
		}
	case []any:
		for i, item := range v {
			v[i] = typed(item)
		}
	}
	return v
}
