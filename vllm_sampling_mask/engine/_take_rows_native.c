/* The frontend's per-output row intake in C (the output processor's hot loop while requests
 * get their rows every step: streaming, or FINAL_ONLY with stop strings).
 *
 * `take_rows_every_step` does, for the common outputs, what
 * `vllm_sampling_mask.engine.output_processor._take_rows_every_step_python` does for every
 * output, without the interpreter, and hands every other output back for that Python loop: a
 * held request's output with rows or a finish, several rows, a missing or an extra row.
 * tests/test_native_loops.py compares the two. Built where a C compiler and Python's headers are
 * found (an optional extension, setup.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030D0000 /* PyObject_GetOptionalAttr is new in 3.13 */
#define PyObject_GetOptionalAttr _PyObject_LookupAttr
#endif

#include "../_slot_fields.h"

static PyObject *str_compact, *str_blob, *str_lengths, *str_append;

/* The fields the loop reads at their slot offsets: of every output (EngineCoreOutput: msgspec)
 * and of its request's row list (RequestMaskRows: __slots__). */
enum { REQUEST_ID, SAMPLING_MASK, FINISH_REASON, NEW_TOKEN_IDS };
static SlotFields output_fields;
enum { HELD, PENDING, BLOCKS };
static SlotFields rows_fields;

/* holder.blob += row; holder.lengths.append(len(row) >> 2): 1, or -1 on error. */
static int
append_to_blob(PyObject *holder, PyObject *row)
{
    PyObject *blob = PyObject_GetAttr(holder, str_blob);
    if (blob == NULL)
        return -1;
    PyObject *joined = PyNumber_InPlaceAdd(blob, row); /* the bytearray itself, grown */
    Py_DECREF(blob);
    if (joined == NULL)
        return -1;
    int failed = PyObject_SetAttr(holder, str_blob, joined);
    Py_DECREF(joined);
    if (failed)
        return -1;
    PyObject *lengths = PyObject_GetAttr(holder, str_lengths);
    if (lengths == NULL)
        return -1;
    PyObject *length = PyLong_FromSsize_t(PyBytes_GET_SIZE(row) >> 2);
    PyObject *none = length == NULL ? NULL
                                    : PyObject_CallMethodOneArg(lengths, str_append, length);
    Py_XDECREF(length);
    Py_DECREF(lengths);
    if (none == NULL)
        return -1;
    Py_DECREF(none);
    return 1;
}

/* 1: the output's row was taken (or it needs none); 0: leave it to the Python loop; -1: error.
   *lockstep is set where the output's request gets its rows every step. */
static int
take_one(PyObject *output, PyObject *states, PyObject *rows_attr, Py_ssize_t compact_rows,
         int *lockstep)
{
    PyObject *request_id = slot_field(&output_fields, output, REQUEST_ID);
    if (request_id == NULL)
        return -1;
    PyObject *state = PyDict_GetItemWithError(states, request_id); /* borrowed */
    Py_DECREF(request_id);
    if (state == NULL)
        return PyErr_Occurred() ? -1 : 1; /* no request state: nothing to add to */
    PyObject *holder;
    if (PyObject_GetOptionalAttr(state, rows_attr, &holder) < 0)
        return -1;
    if (holder == NULL)
        return 1; /* a request without a row list */
    int result = -1;
    PyObject *row = NULL, *new_token_ids = NULL, *pending = NULL;
    PyObject *held = slot_field(&rows_fields, holder, HELD);
    if (held == NULL)
        goto done;
    int is_held = PyObject_IsTrue(held);
    Py_DECREF(held);
    if (is_held < 0 || (row = slot_field(&output_fields, output, SAMPLING_MASK)) == NULL)
        goto done;
    if (is_held) {
        if (row != Py_None) {
            result = 0;
            goto done;
        }
        PyObject *reason = slot_field(&output_fields, output, FINISH_REASON);
        if (reason == NULL)
            goto done;
        result = reason == Py_None; /* a finish: the Python loop checks its row count */
        Py_DECREF(reason);
        goto done;
    }
    *lockstep = 1;
    if ((new_token_ids = slot_field(&output_fields, output, NEW_TOKEN_IDS)) == NULL)
        goto done;
    Py_ssize_t num_new = PyObject_Length(new_token_ids);
    if (num_new < 0)
        goto done;
    if (row == Py_None) {
        result = num_new == 0; /* no token, no row; a token without a row fails in Python */
        goto done;
    }
    if (num_new != 1 || !PyBytes_CheckExact(row)) {
        result = 0;
        goto done;
    }
    if ((pending = slot_field(&rows_fields, holder, PENDING)) == NULL)
        goto done;
    if (pending == Py_None) { /* CUMULATIVE: RequestMaskRows.append's first branch */
        result = append_to_blob(holder, row);
        goto done;
    }
    if (!PyList_CheckExact(pending)) {
        result = 0;
        goto done;
    }
    if (PyList_Append(pending, row) < 0)
        goto done;
    result = 1;
    if (PyList_GET_SIZE(pending) >= compact_rows) {
        PyObject *blocks = slot_field(&rows_fields, holder, BLOCKS);
        if (blocks == NULL) {
            result = -1;
            goto done;
        }
        if (blocks != Py_None) { /* FINAL_ONLY: join the pending rows into a block */
            PyObject *none = PyObject_CallMethodNoArgs(holder, str_compact);
            if (none == NULL)
                result = -1;
            Py_XDECREF(none);
        }
        Py_DECREF(blocks);
    }
done:
    Py_XDECREF(pending);
    Py_XDECREF(new_token_ids);
    Py_XDECREF(row);
    Py_DECREF(holder);
    return result;
}

PyDoc_STRVAR(take_rows_every_step_doc,
"take_rows_every_step(outputs, states, rows_attr, compact_rows) -> (lockstep_seen, rest)\n\n"
"outputs: list of EngineCoreOutputWithMask; states: request id -> RequestState, whose row\n"
"list (RequestMaskRows) is its attribute rows_attr. Appends each one-token output's row\n"
"(bytes) to its request's rows (pending; CUMULATIVE: blob and lengths), compacting a\n"
"FINAL_ONLY request's every compact_rows rows, and skips the outputs that need nothing.\n"
"rest: the other outputs, in order, for the Python loop. lockstep_seen: an output of a\n"
"request whose rows come every step was taken.");

static PyObject *
take_rows_every_step(PyObject *self, PyObject *args)
{
    PyObject *outputs, *states, *rows_attr;
    Py_ssize_t compact_rows;
    if (!PyArg_ParseTuple(args, "O!O!Un:take_rows_every_step", &PyList_Type, &outputs,
                          &PyDict_Type, &states, &rows_attr, &compact_rows))
        return NULL;
    PyObject *rest = PyList_New(0);
    if (rest == NULL)
        return NULL;
    int lockstep = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *output = PyList_GET_ITEM(outputs, i);
        Py_INCREF(output); /* compact() runs Python code: keep the output alive */
        int taken = take_one(output, states, rows_attr, compact_rows, &lockstep);
        int failed = taken < 0 || (taken == 0 && PyList_Append(rest, output) < 0);
        Py_DECREF(output);
        if (failed) {
            Py_DECREF(rest);
            return NULL;
        }
    }
    return Py_BuildValue("(ON)", lockstep ? Py_True : Py_False, rest);
}

static PyMethodDef methods[] = {
    {"take_rows_every_step", take_rows_every_step, METH_VARARGS, take_rows_every_step_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_take_rows_native",
    "The output processor's row intake in C (see _take_rows_native.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__take_rows_native(void)
{
    static const char *const output_field_names[] = {"request_id", "sampling_mask",
                                                     "finish_reason", "new_token_ids", NULL};
    static const char *const rows_field_names[] = {"held", "pending", "blocks", NULL};
    if (slot_fields_init(&output_fields, output_field_names) < 0
        || slot_fields_init(&rows_fields, rows_field_names) < 0
        || (str_compact = PyUnicode_InternFromString("compact")) == NULL
        || (str_blob = PyUnicode_InternFromString("blob")) == NULL
        || (str_lengths = PyUnicode_InternFromString("lengths")) == NULL
        || (str_append = PyUnicode_InternFromString("append")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
